source .gpu/common.sh
R=$OUT/r; mkdir -p $R
which nvidia-cuda-mps-control nvidia-smi; ls /usr/local/nvidia/bin 2>/dev/null | head; nvidia-smi -q | grep -i "compute mode" 
S="python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --in-process"
part plain 120 $S --out $R/plain
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d; echo "mps start rc=$?"; sleep 2
python3 -c "import torch; x=torch.ones(4,device='cuda'); print('cuda under mps ok', x.sum().item())"
echo get_server_list | nvidia-cuda-mps-control
part mps 120 $S --out $R/mps
echo get_server_list | nvidia-cuda-mps-control
cat /tmp/mps-log/control.log 2>/dev/null | tail -5; cat /tmp/mps-log/server.log 2>/dev/null | tail -5
echo quit | nvidia-cuda-mps-control
for d in plain mps; do echo "== $d"; grep "^|" $R/$d/speed.md | cut -d'|' -f2-14,20-26; done
cp $OUT/*.log $R/ 2>/dev/null; rm -f $OUT/*.log
tar czf $OUT/r.tgz -C $OUT r; rm -rf $R
cat $OUT/parts.txt
