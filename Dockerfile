# The Airflow image of docker-compose.yaml and of the Helm route (deploy/helm/values.yaml): the
# official image plus this project's runtime pins, its package, its DAGs and its UI plugin. Not
# built here (no Docker engine on the dev/CI machines); tests/integrity/test_compose.py and
# tests/integrity/test_helm.py check it statically (base tag = the apache-airflow pin, test-only
# packages left out, DAGs and plugin where the chart's pods look for them).
FROM apache/airflow:3.3.2-python3.11

# Runtime pins only (requirements.txt without the test stack: pytest, pytest-timeout, moto). The
# image's own constraints stay in force for everything else; `apache-airflow==` is repeated so pip
# can never up- or downgrade Airflow itself. celery[redis]==5.6.3 matters here too: celery 5.7.0
# breaks apache-airflow-providers-celery 3.26.0.
COPY --chown=airflow:0 requirements.txt pyproject.toml /opt/dflash/
COPY --chown=airflow:0 include /opt/dflash/include
RUN grep -vE '^(pytest|moto)' /opt/dflash/requirements.txt > /tmp/runtime-requirements.txt \
 && pip install --no-cache-dir "apache-airflow==3.3.2" -r /tmp/runtime-requirements.txt \
 && pip install --no-cache-dir --no-deps /opt/dflash \
 && rm /tmp/runtime-requirements.txt

# The DAGs and the progress-page plugin, baked in: AIRFLOW_HOME is /opt/airflow in the official
# image, and Airflow reads $AIRFLOW_HOME/dags and $AIRFLOW_HOME/plugins by default (the Helm chart's
# dags.mountPath defaults to the same place, so with dags.persistence and dags.gitSync off every pod
# runs these files). docker compose bind-mounts ./dags and ./plugins over them for development.
COPY --chown=airflow:0 dags /opt/airflow/dags
COPY --chown=airflow:0 plugins /opt/airflow/plugins
