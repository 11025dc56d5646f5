# session 25, call F: issue 14's lines after the attention kernel's split count stopped compiling mid-serving (the
# in-process baseline's first batch-32 K = 3 row no longer stalls): the same command as session 24's calls B-D
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part speed 230 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed,fixed/no-mixed --in-process --out $R/speed; snap
grep "^|" $R/speed.log | cut -d'|' -f2-5,7,9,13,14,17,18,20-25
cat $OUT/parts.txt
