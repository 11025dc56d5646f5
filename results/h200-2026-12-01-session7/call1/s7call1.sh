source .gpu/common.sh
part tests 330 python3 -m pytest -q tests/test_gpu_prefill.py tests/test_prefill_kernels.py tests/test_gpu.py tests/test_gpu_graphs.py tests/test_lossless_rows.py tests/test_kernel_rows.py tests/test_draft_chain.py tests/test_gpu_bridge.py
tail -n 15 $OUT/tests.log | grep -v "^\.*$\|^[.s]*\s*\[" 
part gateway 60 python3 -m tandem bench gateway --batches 1,8,32 --output-tokens 128,1024 --repeats 2
cat $OUT/gateway.log; cat $OUT/parts.txt
