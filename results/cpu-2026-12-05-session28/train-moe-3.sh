cd /work/main
for rep in 3; do for moe in dense grouped; do ed=2
    .venv/bin/python -m tandem train --edition $ed --moe $moe --device cpu --corpus /tmp/c/stdlib --max-files 200 --seq-len 512 \
      --batch-size 4 --micro-batch 4 --max-steps 8 --warmup-steps 2 --eval-every 1000 --eval-seqs 2 --max-minutes 30 \
      --reserve-s 1 --out /tmp/tb/r$rep-e$ed-$moe --work-dir /tmp/tb/rw$rep-e$ed-$moe > /tmp/tb/r$rep-e$ed-$moe.log 2>&1
    python3 -c "import json; d=json.load(open('/tmp/tb/r$rep-e$ed-$moe/train_log.json')); print('rep $rep edition $ed $moe', round(d['tokens_per_s_after_first_step']), 'tok/s', round(d['train_seconds']), 's')"
done; done
