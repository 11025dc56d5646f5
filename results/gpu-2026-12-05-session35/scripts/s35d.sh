# session 35, call D (one GPU): cProfile of the round's handlers in each served process (site35 probe's TANDEM_CPROF_DIR:
# the draft's _propose, the target's Verify, the gateway's commit), K = 3 at batch 32 and batch 1, ~200 s
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
OLDPP=$PYTHONPATH
for b in 32 1; do
  export TANDEM_CPROF_DIR=$R/cp$b PYTHONPATH=$PWD/.gpu/site35:$OLDPP
  part cp$b 200 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 3 --batches $b --max-tokens 64 --requests-per-batch 3 --synthetic-acceptance 0.85 --speculation fixed --out $R/c$b
  unset TANDEM_CPROF_DIR; export PYTHONPATH=$OLDPP
  for f in $R/cp$b/*.prof; do python3 -c "
import pstats,sys; p=pstats.Stats(sys.argv[1]); p.sort_stats('tottime').print_stats(45); p.sort_stats('cumulative').print_stats(60)" $f > $f.txt 2>&1; done
  snap
done
python3 .gpu/micro35.py > $R/micro.txt 2>&1; snap; cat $R/micro.txt
grep -h "^|" $R/c32/speed.md $R/c1/speed.md | cut -d'|' -f2-12,19
cat $OUT/parts.txt
