# session 35, call C (one GPU): where a K = 3 round's time after the target's verify compute goes, batch 32 then batch 1
# (site35 phase probe: every process logs its round functions' start/end; .gpu/phases35.py reads them), ~300 s
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
OLDPP=$PYTHONPATH
for b in 32 1; do
  export TANDEM_PHASES_DIR=$R/ph$b PYTHONPATH=$PWD/.gpu/site35:$OLDPP
  part ph$b 200 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 3 --batches $b --max-tokens 64 --requests-per-batch 3 --synthetic-acceptance 0.85 --speculation fixed --out $R/p$b
  unset TANDEM_PHASES_DIR; export PYTHONPATH=$OLDPP
  python3 .gpu/phases35.py $R/ph$b > $R/phases$b.txt 2>&1; rm -rf $R/ph$b; snap
  grep -v "^names" $R/phases$b.txt
done
grep -h "^|" $R/p32/speed.md $R/p1/speed.md | cut -d'|' -f2-12,19
cat $OUT/parts.txt
