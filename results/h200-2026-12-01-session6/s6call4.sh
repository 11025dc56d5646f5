source .gpu/common.sh
part probe 40 python3 .gpu/s6probe4.py
part rows 70 python3 -m tandem bench rows --device cuda --random-config v2-lite --quantization none --batches 1,8,32 --prompt-tokens 1200 --out /tmp/rows
cp /tmp/rows/rows.md $OUT/rows.md 2>/dev/null
part speed 200 python3 -m tandem bench speed --device cuda --random-config v2-lite --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed,adaptive --ks 0,3 --batches 1,8,32 --max-tokens 64 --requests-per-batch 2 --repeats 2 --out /tmp/r1
cp /tmp/r1/*.md $OUT/ 2>/dev/null
part tests 170 python3 -m pytest -q tests/test_lossless_rows.py tests/test_kernel_rows.py tests/test_gpu_graphs.py tests/test_gpu.py tests/test_draft_chain.py tests/test_model_kernels.py
tail -n 12 $OUT/tests.log | grep -v "^\.\|^s"; cat $OUT/probe.log $OUT/rows.md; cat /tmp/r1/*.md | head -16; cat $OUT/parts.txt
