# session 30, call D: batch 32 at 256 tokens a request: closed loop (0.85) beside call C's queued row, and queued R1-like
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part c256 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 32 --max-tokens 256 --requests-per-batch 3 --synthetic-acceptance 0.85 --speculation fixed --out $R/c256; snap
part q256r1 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 32 --max-tokens 256 --requests-per-batch 3 --clients queued --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --out $R/q256r1; snap
grep -h "^|" $R/c256/speed.md $R/q256r1/speed.md | cut -d'|' -f2-9,20-23
cat $OUT/parts.txt
