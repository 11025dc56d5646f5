# session 37, call A (one GPU): the GPU tests at this tree (a Verify's rows pushed before its acceptance, on the CUDA
# IPC ring; the seeded requests' pinned k; the non-streamed disconnect), then issue 14's standard command with the
# 0.85 profile on the base tree (7cf464f: the committed rows pushed after the acceptance) and on this tree, one after
# the other on the same machine. ~540 s. Copy to .gpu/ beside common.sh (results/h200-2026-12-04-session21/common.sh)
# with .gpu/base37.tgz (`git archive 7cf464f -- . ':!checkpoints' ':!results' | gzip > .gpu/base37.tgz`);
# carry [".whl", ".gpu"]; park results/ and checkpoints/ outside the tree for the call.
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part gtest 230 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_bridge.py tests/test_propose_ahead.py tests/test_bench.py -k "not served_split"; snap
mkdir -p /tmp/base && tar xzf .gpu/base37.tgz -C /tmp/base
(cd /tmp/base && python3 -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/tandem/v1/*.proto)
S="-m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 3 --synthetic-acceptance 0.85 --speculation fixed --in-process --repeats 2"
part base 150 bash -c "cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base python3 $S --out $R/base"; snap
part new 150 python3 $S --out $R/new; snap
for t in base new; do echo "== $t"; grep -h "^|" $R/$t/speed.md | cut -d'|' -f2-6,9-14,21-; done
cat $OUT/parts.txt
