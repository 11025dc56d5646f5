source .gpu/common.sh
S="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85"
part lanes 100 python3 -m pytest -q -p no:cacheprovider tests/test_local_lane.py tests/test_lanes.py
part local 200 $S --in-process --out /tmp/r/local
part stream 140 $S --service-calls stream --out /tmp/r/stream
part spin0 140 $S --lane-spin-ms 0 --out /tmp/r/spin0
for d in local stream spin0; do echo "== $d"; grep "^|" /tmp/r/$d/speed.md | cut -d'|' -f2-26; done
grep -h "local lane\|gRPC stream is used" $OUT/*.log | head -8
cp $OUT/*.log /tmp/r/ 2>/dev/null; tar czf $OUT/r.tgz -C /tmp r; rm -f $OUT/*.log
cat $OUT/parts.txt
