source .gpu/common.sh
B="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3"
part mixb1n 240 $B --speculation fixed,adaptive,fixed/serial --workload mixed --batches 1 --max-tokens 128 --requests-per-batch 4 --repeats 4 --out /tmp/mixb1n
grep "^|" /tmp/mixb1n/speed.md | cut -c1-300
grep -h "^served" $OUT/mixb1n.log
tar czf $OUT/res.tgz -C /tmp mixb1n 2>/dev/null; gzip -f $OUT/*.log
cat $OUT/parts.txt
