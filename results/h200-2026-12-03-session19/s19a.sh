source .gpu/common.sh
R=$OUT/r; mkdir -p $R
part gt 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_bridge.py tests/test_draft_chain.py tests/test_gpu_fp8.py -k "not flashinfer"
part speed 190 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --speculation fixed,fixed/no-ahead --in-process --out $R/speed
part prof8 45 python3 -m tandem bench profile --device cuda --random-config v2-lite --quantization fp8 --synthetic-acceptance 0.85 --ks 0 --batches 1 --max-tokens 32 --out $R/prof8
part moe 110 python3 .gpu/moe19.py $R/moe.json 95
grep -E "passed|failed|FAILED|Error" $OUT/gt.log | tail -6
grep "^|" $R/speed/speed.md | cut -d'|' -f2-16
head -1 $R/prof8/*.txt; sed -n '/operators by device time/,$p' $R/prof8/*.txt | cut -c1-56,120-200 | head -30
grep "^N=" $OUT/moe.log
cp $OUT/*.log $R/ 2>/dev/null
cat $OUT/parts.txt
