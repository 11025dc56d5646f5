# sourced first by every .gpu/s*.sh: wheels, protobuf stubs, and `part NAME LIMIT CMD...` (a logged, timed step)
set +e
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $OUT/pip.log 2>&1
export PYTHONPATH=/tmp/site:$PWD
python3 -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/tandem/v1/*.proto || echo PROTO FAILED
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt 2>&1
mkdir -p /tmp/r
T0=$(date +%s)
part() {  # part NAME LIMIT_S CMD...: CMD's output in $OUT/NAME.log, its rc and seconds in $OUT/parts.txt
  local name=$1 lim=$2; shift 2
  local t=$(date +%s)
  timeout -k 5 $lim "$@" > $OUT/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t ))s (at $(( $(date +%s) - T0 ))s)" >> $OUT/parts.txt
  tail -3 $OUT/$name.log
}
