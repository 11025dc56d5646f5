source .gpu/common.sh


part speed 420 python3 -m tandem bench speed --device cuda --random-config v2-lite --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed,fixed/serial --ks 0,3 --batches 1,8,32 --max-tokens 64 --requests-per-batch 2 --repeats 2 --out /tmp/r1
cp /tmp/r1/*.md /tmp/r1/*.json $OUT/ 2>/dev/null
grep -v "^20" $OUT/speed.log | grep "served" | tail -40; cat /tmp/r1/*.md | head -24; cat $OUT/parts.txt
