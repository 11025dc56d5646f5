# session 29 call D: edition 3 (build/ck3 on the warm machine) served and in-process speed, real acceptance, greedy
source .gpu/common.sh
[ -f build/ck3/config.json ] || { echo "no build/ck3: fresh machine"; exit 1; }
R=$OUT/r; mkdir -p $R
part e3speed 300 python3 -m tandem bench speed --device cuda --model build/ck3 --ks 0,3 --batches 1,8,32 --max-tokens 64 --requests-per-batch 1 --in-process --out $R/e3speed
part e3steps 120 python3 -m tandem bench steps --device cuda --model build/ck3 --batches 1,8,32 --iters 50
cp $OUT/*.log $OUT/parts.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r
