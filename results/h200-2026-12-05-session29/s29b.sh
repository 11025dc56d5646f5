# session 29 call E: edition 3 batch 1 again (3 requests per batch), and its steps with more iterations
source .gpu/common.sh
[ -f build/ck3/config.json ] || { echo "no build/ck3: fresh machine"; exit 1; }
R=$OUT/r; mkdir -p $R
part e3b1 150 python3 -m tandem bench speed --device cuda --model build/ck3 --ks 0,3 --batches 1 --max-tokens 64 --requests-per-batch 3 --in-process --out $R/e3b1
part e3steps2 60 python3 -m tandem bench steps --device cuda --model build/ck3 --batches 1,8,32 --iters 200
cp $OUT/*.log $OUT/parts.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r
