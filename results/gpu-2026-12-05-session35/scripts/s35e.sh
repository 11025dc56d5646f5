# session 35, call E (one GPU): late admission side by side (fixed,fixed/late: a gateway each on one target and draft),
# issue 14's 64-token command at batch 1 and 32, then 256-token requests at batch 32, ~420 s
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
S="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --synthetic-acceptance 0.85 --speculation fixed,fixed/late"
part l64 280 $S --batches 1,32 --max-tokens 64 --requests-per-batch 4 --repeats 2 --out $R/l64; snap
grep -h "^|" $R/l64/speed.md | cut -d'|' -f2-12,19
part l256 200 $S --batches 32 --max-tokens 256 --requests-per-batch 2 --out $R/l256; snap
grep -h "^|" $R/l256/speed.md | cut -d'|' -f2-12,19
grep -h "^served" $R/l64.log $R/l256.log | cut -c1-200
cat $OUT/parts.txt
