# session 30, call C: issue 14's standard command after the seed fix (in process now draws the same synthetic
# acceptance as served: equal MAL), then batch 32 at 256 tokens a request, closed and queued (0.85)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
git log -1 --format=%h > $R/commit.txt 2>/dev/null
part s64 290 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --out $R/s64; snap
part q256 230 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 32 --max-tokens 256 --requests-per-batch 3 --clients queued --synthetic-acceptance 0.85 --speculation fixed --out $R/q256; snap
grep -h "^|" $R/s64/speed.md $R/q256/speed.md | cut -d'|' -f2-9,20-23
cat $OUT/parts.txt
