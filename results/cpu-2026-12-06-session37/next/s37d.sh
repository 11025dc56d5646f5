# session 37, call D (one GPU): the batch-32 K = 3 round's phases at this tree (site36 probe) and a batch-32 verify
# step against a decode step kernel by kernel (where the K = 3 verify's extra ~1.6-2.1 ms goes). ~300 s
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part vk 110 python3 .gpu/verify_kernels36.py 32; snap; head -34 $R/vk.log
OLDPP=$PYTHONPATH
export TANDEM_PHASES_DIR=$R/ph32 PYTHONPATH=$PWD/.gpu/site36:$OLDPP
part ph32 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 3 --batches 32 --max-tokens 64 --requests-per-batch 3 --synthetic-acceptance 0.85 --speculation fixed --out $R/p32
unset TANDEM_PHASES_DIR; export PYTHONPATH=$OLDPP
python3 .gpu/phases36.py $R/ph32 > $R/phases32.txt 2>&1; rm -rf $R/ph32; snap
grep -v "^names" $R/phases32.txt
cat $OUT/parts.txt
