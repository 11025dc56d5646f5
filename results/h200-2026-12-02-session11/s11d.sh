source .gpu/common.sh
part gputests 170 python3 -m pytest -q -x tests/test_draft_chain.py tests/test_engines.py -p no:cacheprovider
B="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --speculation fixed,adaptive --workload mixed"
part mixb8 170 $B --batches 8 --max-tokens 96 --requests-per-batch 3 --repeats 2 --out /tmp/mixb8
part mixb32 170 $B --batches 32 --max-tokens 64 --requests-per-batch 2 --repeats 2 --out /tmp/mixb32
for d in mixb8 mixb32; do grep "^|" /tmp/$d/speed.md | cut -c1-300; done
grep -h "^served" $OUT/mixb8.log $OUT/mixb32.log
tar czf $OUT/res.tgz -C /tmp mixb8 mixb32 2>/dev/null; gzip -f $OUT/*.log
cat $OUT/parts.txt
