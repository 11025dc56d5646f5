# session 21, call A: GPU coverage of session 20's last commits, tandem bench attention, the round's profile at K = 3
source .gpu/common.sh
R=$OUT
part gt 230 python3 -m pytest -q tests/test_gpu.py tests/test_gpu_bridge.py tests/test_draft_chain.py tests/test_kernel_rows.py -k "not flashinfer"
tail -15 $OUT/gt.log | grep -E "passed|failed|FAIL|Error" 
part dsa 120 python3 -m pytest -q tests/test_gpu_dsa.py tests/test_dsa_kernels.py -k "not flashinfer"
part attn 100 python3 -m tandem bench attention --device cuda --out $R/attn
part prof 120 python3 -m tandem bench profile --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 3 --batches 1,32 --max-tokens 32 --top 40 --out $R/prof
cat $OUT/parts.txt
