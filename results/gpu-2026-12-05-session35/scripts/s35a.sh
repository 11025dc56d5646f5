# session 35, call A (one GPU): the GPU end-to-end tests (joins on CUDA), then joins riding the push against joins apart, side by side in one run (issue 14's
# standard command with fixed,fixed/no-join), ~480 s (then s35b.sh: 256-token requests)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part gtest 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_propose_ahead.py; snap
S="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --synthetic-acceptance 0.85 --speculation fixed,fixed/no-join"
part j64 280 $S --batches 1,32 --max-tokens 64 --requests-per-batch 4 --repeats 2 --out $R/j64; snap
grep -h "^|" $R/j64/speed.md | cut -d'|' -f2-12,19
cat $OUT/parts.txt
