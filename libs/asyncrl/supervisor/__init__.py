"""The local supervisor behind `make up`: nats-server plus the services as restarted processes.

    python -m asyncrl.supervisor start [--var var] [--services scheduler,reward,rollout,trainer]
    python -m asyncrl.supervisor ps | logs [SERVICE] [-f] | scale SERVICE N | stop

Environment (read through asyncrl.settings; the flags win): ASYNCRL_METRICS_PORT=B (metrics ports
from B: scheduler B, trainer B+1, rollout replica i B+10+i), ASYNCRL_TRAINER_NPROC=N (each
trainer under torchrun with N ranks), ASYNCRL_NATS_PORT, ASYNCRL_SCHEDULER_PORT, ASYNCRL_VAR,
ASYNCRL_ROLLOUT_ENGINE and ASYNCRL_<SERVICE>_ARGS (extra flags for one service).

`daemon` holds the process supervision (pure restart policy, replica bookkeeping); `commands`
the CLI that starts, inspects and stops it; `asyncrl.proc` the process inspection (psutil).
"""

from asyncrl.proc import pid_alive
from asyncrl.supervisor.daemon import Paths, Supervisor, backoff_s, port_in_use

__all__ = ["Paths", "Supervisor", "backoff_s", "pid_alive", "port_in_use"]
