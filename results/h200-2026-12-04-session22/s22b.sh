# session 22, call B: PDL on/off in one process (pure graph replays), the served batch-1 step's host side, bench profile
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
part host 120 python3 .gpu/host22.py
grep "^==" $OUT/host.log
part prof 150 python3 -m tandem bench profile --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --out $R/prof
head -3 $R/prof/*.txt
part kt 200 python3 -m pytest -q -x tests/test_fp8_kernels.py tests/test_moe_kernels.py tests/test_model_kernels.py
tail -3 $OUT/kt.log
cp $OUT/*.log $OUT/*.txt $R/ 2>/dev/null; rm -f $OUT/*.log
tar czf $OUT/r.tgz -C $OUT r; rm -rf $R
cat $OUT/parts.txt
