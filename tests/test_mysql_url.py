"""MySqlSink's reading of Spark's JDBC url (issue 49), no server needed: what a read-only review
of the sink found (credentials in the url's host part reached the sink's host name and messages;
TLS settings were silently dropped; any other property was silently ignored)."""

from __future__ import annotations

import pytest

pytest.importorskip("pymysql")

from twophase.errors import ConfigurationError  # noqa: E402
from twophase.sinks.mysql import sink_from_jdbc_options  # noqa: E402

SECRET = "Zq7secret"


@pytest.mark.parametrize("url", [
    f"jdbc:mysql://u:{SECRET}@db.example:3306/shop",
    f"jdbc:mysql://u:{SECRET}@db.example/shop",
    f"jdbc:mysql://address=(host=db.example)(port=3306)(user=u)(password={SECRET})/shop",
    f"jdbc:mariadb://db.example:{SECRET}/shop",
])
def test_credentials_or_garbage_in_the_url_authority_are_refused_without_quoting_it(url):
    with pytest.raises(ConfigurationError) as e:
        sink_from_jdbc_options({"url": url, "dbtable": "orders"})
    assert SECRET not in str(e.value)
    assert "not quoted" in str(e.value)


@pytest.mark.parametrize("prop", ["sslMode=VERIFY_IDENTITY", "useSSL=true", "requireSSL=true",
                                  "trustCertificateKeyStoreUrl=file:/ts.jks", "sslmode=verify-full"])
def test_a_tls_requirement_in_the_url_is_refused_by_name_not_dropped(prop):
    with pytest.raises(ConfigurationError, match=f"url's {prop.split('=')[0]} is not supported.*TLS"):
        sink_from_jdbc_options({"url": f"jdbc:mysql://db.example:3306/shop?{prop}", "dbtable": "t",
                                "password": "pw-123"})


@pytest.mark.parametrize("prop", ["serverTimezone=UTC", "sessionVariables=sql_mode=ANSI", "characterEncoding=latin1"])
def test_another_url_property_is_refused_by_name(prop):
    with pytest.raises(ConfigurationError, match=f"url's {prop.split('=')[0]}"):
        sink_from_jdbc_options({"url": f"jdbc:mysql://db.example:3306/shop?{prop}", "dbtable": "t"})


def test_properties_with_the_same_meaning_are_accepted():
    """Including the TLS settings that say "no TLS", which is what the sink's connections do."""
    sink = sink_from_jdbc_options({
        "url": "jdbc:mysql://[::1]:3307/shop?useUnicode=true&characterEncoding=UTF-8&rewriteBatchedStatements=true"
               "&useSSL=false&sslMode=DISABLED&user=writer", "dbtable": "orders", "password": "pw-123"})
    assert (sink.host, sink.port, sink.database, sink.table, sink.user) == ("::1", 3307, "shop", "orders", "writer")
    assert "pw-123" not in repr(sink) and "pw-123" not in str(sink.to_config())
