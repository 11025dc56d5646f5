cd /work/main
for moe in dense grouped; do
  for ed in 2 3; do
    .venv/bin/python -m tandem train --edition $ed --moe $moe --device cpu --corpus /tmp/c/stdlib --max-files 200 --seq-len 512 \
      --batch-size 4 --micro-batch 4 --max-steps 6 --warmup-steps 2 --eval-every 1000 --eval-seqs 2 --max-minutes 30 \
      --reserve-s 1 --out /tmp/tb/e$ed-$moe --work-dir /tmp/tb/w$ed-$moe > /tmp/tb/e$ed-$moe.log 2>&1
    python3 -c "import json; d=json.load(open('/tmp/tb/e$ed-$moe/train_log.json')); print('edition $ed $moe', d['params'], round(d['tokens_per_s_after_first_step']), 'tok/s')"
  done
done
