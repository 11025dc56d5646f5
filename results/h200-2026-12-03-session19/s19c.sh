source .gpu/common.sh
R=$OUT/r; mkdir -p $R
mkdir -p /tmp/old && tar xf .gpu/old.tar -C /tmp/old && cp tandem/v1/*_pb2*.py /tmp/old/tandem/v1/ && cp -r proto checkpoints /tmp/old/ 2>/dev/null
part kq 80 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kernels.py -k "split_sums or gemm_matches or moe" -x
part sweep 170 python3 -m tandem bench fp8-sweep --budget-s 110 --out $R/sweep
test -f $R/sweep/fp8_config.py && cp $R/sweep/fp8_config.py kernels/triton_fp8_config.py && echo CONFIG INSTALLED
part fp8new 75 python3 -m tandem bench fp8 --parts v2lite --out $R/fp8new
part fp8old 75 env PYTHONPATH=/tmp/site:/tmp/old sh -c "cd /tmp/old && python3 -m tandem bench fp8 --parts v2lite --out $R/fp8old"
part prof8 45 python3 -m tandem bench profile --device cuda --random-config v2-lite --quantization fp8 --synthetic-acceptance 0.85 --ks 0 --batches 1 --max-tokens 32 --out $R/prof8
part moe 30 python3 .gpu/moe19.py $R/moe.json 0
part kt 120 python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kernels.py tests/test_moe_kernels.py -x
grep -E "passed|failed|FAILED|Error" $OUT/kq.log $OUT/kt.log | tail -8
grep -E "^\| *V2-Lite" $R/sweep/fp8_sweep.md | head -30
for d in fp8new fp8old; do echo "== $d"; grep -A6 "^| weights" $R/$d/fp8.md; done
head -1 $R/prof8/*.txt; sed -n '/operators by device time/,$p' $R/prof8/*.txt | cut -c1-56,120-200 | head -24
grep "^N=" $OUT/moe.log
cp $OUT/*.log $R/ 2>/dev/null; rm -f $OUT/*.log
tar czf $OUT/r.tgz -C $OUT r; rm -rf $R
cat $OUT/parts.txt
