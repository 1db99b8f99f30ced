from asyncrl.supervisor.commands import app

app()
