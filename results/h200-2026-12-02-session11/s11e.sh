source .gpu/common.sh
part gputests 120 python3 -m pytest -q -x tests/test_draft_chain.py tests/test_engines.py -p no:cacheprovider
part mixb8 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --speculation fixed --workload mixed --batches 8 --max-tokens 96 --requests-per-batch 3 --repeats 2 --out /tmp/mixb8
grep "^|" /tmp/mixb8/speed.md | cut -c1-300
grep -h "^served" $OUT/mixb8.log
tar czf $OUT/res.tgz -C /tmp mixb8 2>/dev/null; gzip -f $OUT/*.log
cat $OUT/parts.txt
