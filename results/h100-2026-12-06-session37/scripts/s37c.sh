# session 37, call C: the GPU tests verbose (call A's run failed one and timed out), then the b1 pair in the other order
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part gtest 420 python3 -m pytest -v -rfE -x --timeout 200 -p no:cacheprovider tests/test_gpu.py tests/test_gpu_bridge.py tests/test_propose_ahead.py tests/test_bench.py -k "not served_split" --durations 15; snap
grep -E "FAIL|PASS|ERROR" $R/gtest.log | tail -60
cat $OUT/parts.txt
