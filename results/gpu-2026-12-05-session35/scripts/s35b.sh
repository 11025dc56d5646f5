# session 35, call B (one GPU): joins riding the push against joins apart with 256-token requests at batch 32
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
S="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --synthetic-acceptance 0.85 --speculation fixed,fixed/no-join"
part j256 250 $S --batches 32 --max-tokens 256 --requests-per-batch 2 --out $R/j256; snap
grep -h "^|" $R/j256/speed.md | cut -d'|' -f2-12,19
cat $OUT/parts.txt
