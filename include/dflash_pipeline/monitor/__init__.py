"""Run monitoring: what generate tasks publish (progress), and the Airflow plugin's pages (ui, ui_app).

Imports config and dataset/ only; imported by tasks, the plugin and dev/.
Never imports steps/ or serving/: it reads what they wrote to S3.
"""
