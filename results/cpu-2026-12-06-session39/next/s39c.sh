# session 39, call C (one GPU): where a batch-32 K = 3 round goes with the early push (site39 phase probe), and the
# same with --no-early-propose for the side-by-side. ~330 s
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
git log --oneline -1 > $R/commit.txt 2>&1
OLDPP=$PYTHONPATH
for m in fixed fixed/accept-first; do
  n=$(echo $m | tr '/' '_')
  export TANDEM_PHASES_DIR=$R/ph_$n PYTHONPATH=$PWD/.gpu/site39:$OLDPP
  part ph_$n 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 3 --batches 32 --max-tokens 64 --requests-per-batch 3 --synthetic-acceptance 0.85 --speculation $m --out $R/p_$n
  unset TANDEM_PHASES_DIR; export PYTHONPATH=$OLDPP
  python3 .gpu/phases39.py $R/ph_$n > $R/phases_$n.txt 2>&1; rm -rf $R/ph_$n; snap
  grep -v "^names" $R/phases_$n.txt | head -70
done
cat $OUT/parts.txt
