source .gpu/common.sh
R=$OUT/r; mkdir -p $R
part r1 200 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --in-process --out $R/speed
part fp8 200 python3 -m tandem bench fp8 --parts v2lite,v3 --out $R/fp8
grep "^|" $R/speed/speed.md | cut -d'|' -f2-14,20-26
grep -A8 "^| weights" $R/fp8/fp8.md; grep -B2 -A8 "^| batch | K" $R/fp8/fp8.md
cp $OUT/*.log $R/ 2>/dev/null; rm -f $OUT/*.log
tar czf $OUT/r.tgz -C $OUT r; rm -rf $R
cat $OUT/parts.txt
