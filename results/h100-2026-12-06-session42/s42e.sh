# session 42, call E: the owed GPU files (fp8, FlashInfer sampling), then V2-Lite at this tree (issue 14's model)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
part g 125 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu_flashinfer_sampling.py; snap
tail -4 $R/g.log
part v 120 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 3 --synthetic-acceptance 0.85 --out $R/v; snap
grep -h "^served " $R/v.log; grep -h "^| 0.85" $R/v.log | cut -d'|' -f2-7,10,11,13,14,22-24
cat $OUT/parts.txt
