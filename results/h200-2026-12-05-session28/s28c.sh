# session 28, call C: issue 14's standard command again (run-to-run), 256 tokens at batch 32, the layout A/B, moe28
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part s64b 200 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --out $R/s64b; snap
grep "^|" $R/s64b.log | cut -d'|' -f2-5,7,16-20
part s256 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 32 --max-tokens 256 --requests-per-batch 2 --synthetic-acceptance 0.85 --speculation fixed --in-process --out $R/s256; snap
grep "^|" $R/s256.log | cut -d'|' -f2-5,7,16-20
FILES="models/batch.py models/cuda_graphs.py services/draft/chain.py"
use() { for f in $FILES; do cp .gpu/t27/$1/$f $f; done; }
for i in 1 2; do for t in old new; do use $t; part step-$t$i 40 python3 .gpu/step23.py $t$i; snap; done; done
git checkout -- $FILES 2>/dev/null || use new
grep -h "^==" $R/step-*.log | sort -k3,3 -k5,5n -k7,7n
part moe 120 python3 .gpu/moe28.py $R/moe28.json; snap
cat $OUT/parts.txt
