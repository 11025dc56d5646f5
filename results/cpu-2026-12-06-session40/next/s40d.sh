# session 40, call D: the GPU test files at this session's final code tree (the stop-signal fix is in every service)
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
git log --oneline -1 > $R/commit.txt 2>&1
part ga 290 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu.py tests/test_gpu_bridge.py tests/test_gpu_graphs.py tests/test_lossless_rows.py tests/test_model_kernels.py; snap
part gb 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_gpu_fp8.py tests/test_gpu_dsa.py tests/test_gpu_prefill.py tests/test_gpu_flashinfer_sampling.py; snap
tail -3 $R/ga.log; tail -3 $R/gb.log; cat $OUT/parts.txt
