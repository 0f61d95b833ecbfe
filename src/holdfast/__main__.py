from holdfast.cli import app

app(prog_name="holdfast")
