# session 25, call C: the GPU tests of the commits since session 24's last GPU run (fc95d59, 3e3cfa5, the verify_io
# move, 1ab3268), and the in-process baseline's first-row stall timed call by call (pf25.py)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part gt 290 python3 -m pytest -q tests/test_gpu_graphs.py tests/test_engines.py tests/test_gpu.py tests/test_lossless_rows.py tests/test_gpu_prefill.py tests/test_mixed_prefill.py tests/test_chunked_prefill.py -k "not flashinfer"; snap
tail -3 $R/gt.log
part pf 150 python3 .gpu/pf25.py; snap
grep -v "^     " $R/pf.log | tail -60
cat $OUT/parts.txt
