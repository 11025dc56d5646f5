source .gpu/common.sh
part tests 300 python3 -m pytest -q tests/test_attention_rows.py tests/test_gpu_prefill.py tests/test_prefill_kernels.py tests/test_gpu.py tests/test_gpu_graphs.py tests/test_lossless_rows.py tests/test_draft_chain.py
part probe 90 python3 .gpu/s6probe.py
part rows 200 python3 -m tandem bench rows --device cuda --random-config v2-lite --quantization none,fp8 --batches 1,8,32 --prompt-tokens 1200 --out /tmp/rows
cp /tmp/rows/rows.md $OUT/rows.md 2>/dev/null
tail -n 30 $OUT/tests.log | grep -v "^\.\|^s" ; cat $OUT/probe.log $OUT/rows.md; cat $OUT/parts.txt
