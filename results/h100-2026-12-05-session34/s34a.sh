# session 34, call B: the GPU tests in the order most owed first (capture test first), each file timed; bridge generations last
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part graphs 150 python3 -m pytest -q -p no:cacheprovider --durations=15 -rs tests/test_gpu_graphs.py tests/test_gpu_bridge.py tests/test_bridge_transport.py; snap
part kern 150 python3 -m pytest -q -p no:cacheprovider --durations=15 tests/test_lossless_rows.py tests/test_kernel_rows.py tests/test_gpu_fp8.py tests/test_model_kernels.py tests/test_bench_rows.py; snap
part gens 240 python3 -m pytest -v -p no:cacheprovider --durations=30 tests/test_bridge_generations.py tests/test_gpu_graphs.py; snap
tail -5 $R/graphs.log $R/kern.log $R/gens.log
cat $OUT/parts.txt
