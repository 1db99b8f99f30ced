"""The local supervisor behind `make up`: nats-server plus the services as restarted processes.

    python -m asyncrl.supervisor start [--var var] [--services scheduler,reward,rollout,trainer]
    python -m asyncrl.supervisor ps | logs [SERVICE] [-f] | scale SERVICE N | stop

Environment: ASYNCRL_METRICS_PORT=B (metrics ports from B: scheduler B, trainer B+1, rollout
replica i B+10+i), ASYNCRL_TRAINER_NPROC=N (each trainer under torchrun with N ranks).

`daemon` holds the process supervision (pure restart policy, replica bookkeeping); `commands`
the CLI that starts, inspects and stops it.
"""

from asyncrl.supervisor.daemon import Paths, Supervisor, backoff_s, pid_alive, port_in_use

__all__ = ["Paths", "Supervisor", "backoff_s", "pid_alive", "port_in_use"]
