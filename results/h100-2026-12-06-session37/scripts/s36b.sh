# session 36, call B (one GPU): the draft's take and the target's send split finer (site36 probe, phases36.py) at
# batch 1 and 32, K = 3; then batch 1 with queued clients against in process (session 35's cut call); then a batch-32
# verify step against a decode step kernel by kernel (verify_kernels36.py: where the K = 3 verify's +2.3 ms goes), ~550 s
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
OLDPP=$PYTHONPATH
for b in 32 1; do
  export TANDEM_PHASES_DIR=$R/ph$b PYTHONPATH=$PWD/.gpu/site36:$OLDPP
  part ph$b $([ $b = 1 ] && echo 110 || echo 150) python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 3 --batches $b --max-tokens 64 --requests-per-batch 3 --synthetic-acceptance 0.85 --speculation fixed --out $R/p$b
  unset TANDEM_PHASES_DIR; export PYTHONPATH=$OLDPP
  python3 .gpu/phases36.py $R/ph$b > $R/phases$b.txt 2>&1; rm -rf $R/ph$b; snap
  grep -v "^names" $R/phases$b.txt
done
part q1 180 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1 --max-tokens 64 --requests-per-batch 6 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --repeats 2 --clients queued --out $R/q1; snap
grep -h "^|" $R/q1/speed.md | cut -d'|' -f2-6,9,11,14,17,18,20-
part vk 120 python3 .gpu/verify_kernels36.py 32; snap; head -34 $R/vk.log
cat $OUT/parts.txt
