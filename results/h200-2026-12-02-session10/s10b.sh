source .gpu/common.sh
part tests 170 python3 -m pytest -q -x tests/test_engines.py tests/test_draft_chain.py tests/test_triton_kernels.py tests/test_gpu.py -p no:cacheprovider
tail -3 $OUT/tests.log
B="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --workload mixed --speculation fixed,adaptive"
part mixb1 170 $B --batches 1 --max-tokens 128 --requests-per-batch 4 --repeats 3 --out /tmp/mixb1
tar czf $OUT/mixb1.tgz -C /tmp mixb1
part mixb832 250 $B --batches 8,32 --max-tokens 96 --requests-per-batch 3 --repeats 2 --out /tmp/mixb832
tar czf $OUT/mixb832.tgz -C /tmp mixb832
for d in mixb1 mixb832; do grep "^|" /tmp/$d/speed.md | cut -c1-300; done; grep "^served" $OUT/mix*.log | cut -c1-250; cat $OUT/parts.txt | tail -3
