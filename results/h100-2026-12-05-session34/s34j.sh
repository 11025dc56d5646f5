# session 34, last call: joins riding the push against joins apart, batch 32, one run side by side
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part j32 130 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --synthetic-acceptance 0.85 --speculation fixed,fixed/no-join --batches 32 --max-tokens 64 --requests-per-batch 2 --out $R/j32; snap
grep -h "^|" $R/j32/speed.md | cut -d'|' -f2-12,19
cat $OUT/parts.txt
