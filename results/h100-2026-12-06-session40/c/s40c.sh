# session 40, call C: the next Verify laid out ahead (services/target/layout_ahead.py) against the tree before it
# (HEAD 9c40ec9 as .gpu/old.tgz), served, alternating new / old twice; its GPU tests; the layout's host cost here
source .gpu/common.sh
R=$OUT/r; mkdir -p $R /tmp/old && tar xzf .gpu/old.tgz -C /tmp/old
(cd /tmp/old && python3 -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/tandem/v1/*.proto) || echo OLD PROTO FAILED
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; }
part gtest 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_layout_ahead.py tests/test_early_propose.py -k "cuda or laid"; snap
S="-m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 3 --speculation fixed --repeats 2 --synthetic-acceptance 0.85"
for i in 1 2; do
  part new$i 110 python3 $S --out $R/new$i; snap
  part old$i 110 bash -c "cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old python3 $S --out $R/old$i"; snap
done
part prep 60 bash -c "python3 .gpu/prep_bench.py; cp .gpu/batch_numpy.py models/batch.py; python3 .gpu/prep_bench.py; git checkout models/batch.py 2>/dev/null"; snap
for t in new1 old1 new2 old2; do echo "== $t"; grep -h "^| 0.85" $R/$t/speed.md | cut -d'|' -f2-7,10-16; done
cat $R/prep.log; tail -2 $R/gtest.log; cat $OUT/parts.txt
tar czf $OUT/r.tgz -C $OUT r
