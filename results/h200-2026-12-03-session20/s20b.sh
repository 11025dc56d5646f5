# session 20, call B: MLA splits merged in the attention launch (dead splits exit, one live split writes its row),
# the finiteness check inside the IPC take's sync; tests, sweep, step vs floor off/on, served speed, bridge, stacks
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
part gt 230 python3 -m pytest -q tests/test_gpu.py tests/test_gpu_bridge.py tests/test_draft_chain.py tests/test_kernel_rows.py tests/test_model_kernels.py -k "not flashinfer"
tail -5 $OUT/gt.log
part mla 100 python3 .gpu/mla20.py 80
python3 .gpu/mlasum.py $OUT/mla.log > $OUT/mla-summary.txt; cat $OUT/mla-summary.txt
part floor0 60 env TANDEM_ATTENTION_MERGE=0 python3 -m tandem bench floor --device cuda --random-config v2-lite --batches 1,32 --ks 0,3 --prompt-tokens 64 --out $R/floor0
part floor1 60 python3 -m tandem bench floor --device cuda --random-config v2-lite --batches 1,32 --ks 0,3 --prompt-tokens 64 --out $R/floor1
grep "^|" $R/floor0/*.md; grep "^|" $R/floor1/*.md
part fp8 60 python3 -m tandem bench fp8 --parts v2lite --out $R/fp8
grep -A6 "^| weights" $R/fp8/fp8.md
part speed 170 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --in-process --out $R/speed
grep "^|" $R/speed/speed.md | cut -d'|' -f2-14,20-26
part bridge 40 python3 -m tandem bench bridge --device cuda --out $R/bridge
grep "^|" $R/bridge/*.md
part stack 50 python3 .gpu/stack20.py
head -70 $OUT/stack.log
cp $OUT/*.log $OUT/*.txt $R/ 2>/dev/null; rm -f $OUT/*.log
tar czf $OUT/r.tgz -C $OUT r; rm -rf $R
cat $OUT/parts.txt
