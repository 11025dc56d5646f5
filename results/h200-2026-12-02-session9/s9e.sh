source .gpu/common.sh
part mixed 280 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,1,2,3 --batches 1,8,32 --max-tokens 64 --requests-per-batch 2 --repeats 2 --workload mixed --speculation fixed,adaptive --synthetic-acceptance 0.92,0.72,0.36 --out /tmp/mixed
tar czf $OUT/mixed.tgz -C /tmp mixed
grep "^|" /tmp/mixed/speed.md | cut -c1-200; grep "^served" $OUT/mixed.log | tail -3; cat $OUT/parts.txt | tail -1
