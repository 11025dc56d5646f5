# session 26, call A: (1) the verify step's wall at 1ab3268 vs HEAD (kernels/triton_mla.py run-time split count,
# models/cuda_graphs.py decode-form eager step), alternating processes; (2) the served batch-32 K = 3 round under
# TANDEM_PROFILE_DIR (target's Verify and draft's Propose traces); (3) fp8 accuracy of the second bundled model.
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
FILES="kernels/triton_mla.py models/cuda_graphs.py"
use() { for f in $FILES; do cp .gpu/t26/$1/$f $f; done; }
for i in 1 2 3; do
  for t in old new; do use $t; part step-$t$i 60 python3 .gpu/step23.py $t$i; snap; done
done
use new; git status --short 2>/dev/null | head
grep -h "^==" $R/step-*.log | sort -k3,3 -k5,5n -k7,7n
TANDEM_PROFILE_DIR=$R/prof TANDEM_PROFILE_CALLS=50,16 part prof 200 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 3 --batches 32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --speculation fixed --out $R/profspeed; snap
ls -la $R/prof; grep "^|" $R/prof.log | cut -d'|' -f2-14
part fp8acc 200 python3 -m tandem bench fp8 --parts accuracy --out $R/fp8acc; snap
tail -30 $R/fp8acc.log
cat $OUT/parts.txt
