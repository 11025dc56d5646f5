# session 26, call D: + the chain fed the step's last rows as one tensor; GPU tests of the draft and the served
# greedy equality, then issue 14's lines: 64 new tokens (the standard command, fixed only) and 256
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part gt 200 python3 -m pytest -q tests/test_draft_chain.py tests/test_gpu.py tests/test_lossless_rows.py -k "not flashinfer"; snap
tail -2 $R/gt.log; grep -E "^(FAILED|ERROR)" $R/gt.log | head
part s64 200 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --out $R/s64; snap
grep "^|" $R/s64.log | cut -d'|' -f2-5,7,9-14,17,18,20-25
part s256 240 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 32 --max-tokens 256 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --out $R/s256; snap
grep "^|" $R/s256.log | cut -d'|' -f2-5,7,9-14,17,18,20-25
cat $OUT/parts.txt
