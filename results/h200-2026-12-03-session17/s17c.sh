source .gpu/common.sh
R=$OUT/r; mkdir -p $R
part tests2 230 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py tests/test_gpu_bridge.py tests/test_draft_chain.py tests/test_gpu_fp8.py -k "not flashinfer"
P="python3 -m tandem bench profile --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --ks 3 --batches 1,32 --max-tokens 32"
part profin3 75 $P --out $R/pin3
part profoff3 75 env TANDEM_SHARED_IN_MOE=0 $P --out $R/poff3
part moe 110 python3 .gpu/moe17.py $R/moe.json
grep -E "passed|failed|FAILED" $OUT/tests2.log | tail -5
for f in $R/pin3/*.txt $R/poff3/*.txt; do echo $f; head -1 $f; done
grep "^N=" $OUT/moe.log
cat $OUT/parts.txt
