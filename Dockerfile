# The Airflow image of docker-compose.yaml: the official image plus this project's runtime pins and
# package. Not built here (no Docker engine on the dev/CI machines); tests/integrity/test_compose.py
# checks it statically (base tag = the apache-airflow pin, test-only packages left out).
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
