# session 33, call B: the rows-first probe (s31a: the target's two sends alternating round by round, batch 1 K = 3),
# then two micro-batches alternating on one H200 (s32h: one gateway against two, batch 8 and 32)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
export TANDEM_PHASES_DIR=$R/ph TANDEM_ALTERNATE_ORDER=1 OLDPP=$PYTHONPATH PYTHONPATH=$PWD/.gpu/site:$PYTHONPATH
part alt 120 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 3 --batches 1 --max-tokens 64 --requests-per-batch 8 --synthetic-acceptance 0.85 --speculation fixed --out $R/alt; snap
unset TANDEM_PHASES_DIR TANDEM_ALTERNATE_ORDER; export PYTHONPATH=$OLDPP
python3 .gpu/phases30.py $R/ph > $R/phases.txt 2>&1; rm -rf $R/ph; snap
S="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --synthetic-acceptance 0.85 --speculation fixed,fixed/halves"
part h64 300 $S --batches 8,32 --max-tokens 64 --requests-per-batch 2 --repeats 2 --out $R/h64; snap
cat $R/phases.txt; grep -h "^|" $R/alt/speed.md $R/h64/speed.md | cut -d'|' -f2-12
cat $OUT/parts.txt
