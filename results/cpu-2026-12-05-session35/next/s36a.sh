# session 36, call A (one GPU): the GPU tests at this tree (the synthetic acceptance's host draws, late admission, the
# in-process repeats), then late admission side by side again with 3 repeats at batch 8 and 32, ~500 s.
# Copy to .gpu/ beside common.sh (results/h200-2026-12-04-session21/common.sh); carry [".whl", ".gpu"].
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part gtest 220 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_propose_ahead.py tests/test_bench.py -k "not served_split"; snap
S="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --synthetic-acceptance 0.85 --speculation fixed,fixed/late"
part l64 260 $S --batches 8,32 --max-tokens 64 --requests-per-batch 4 --repeats 3 --out $R/l64; snap
grep -h "^|" $R/l64/speed.md | cut -d'|' -f2-12,19
cat $OUT/parts.txt
