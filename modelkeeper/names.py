"""One home for the names several processes must agree on: task queues, workflow ids,
search attributes. Change one here and every worker, client and test follows."""

from __future__ import annotations

from .domain.ids import DeploymentId, NodeId

#: Task queue polled by the control-plane worker (`modelkeeper worker`).
CONTROL_TASK_QUEUE = "modelkeeper-control"

#: Prefix of each node agent's own task queue; activities that touch a node's engines run there.
NODE_TASK_QUEUE_PREFIX = "node/"

#: Custom search attributes registered on the Temporal server (name -> type).
SEARCH_ATTRIBUTES: dict[str, str] = {
    "ModelId": "Keyword",
    "DeploymentStatus": "Keyword",
}


def node_task_queue(node_id: NodeId) -> str:
    """The task queue a node's agent polls."""
    return f"{NODE_TASK_QUEUE_PREFIX}{node_id}"


def deployment_workflow_id(deployment_id: DeploymentId) -> str:
    """The workflow id of a deployment's keeper; one running workflow per deployment."""
    return f"deployment/{deployment_id}"

#: The database `up` creates inside its embedded PostgreSQL, and the superuser initdb
#: makes there (trust auth on loopback only; see docs/architecture.md).
LOCAL_DATABASE_NAME = "modelkeeper"
LOCAL_DATABASE_USER = "postgres"


def local_database_url(host: str, port: int, database: str = LOCAL_DATABASE_NAME) -> str:
    """A libpq/asyncpg DSN for the embedded server of a local `modelkeeper up`."""
    return f"postgresql://{LOCAL_DATABASE_USER}@{host}:{port}/{database}"


#: PostgreSQL NOTIFY channels (see migration 0002); payload is a deployment id.
REPLICAS_CHANNEL = "modelkeeper_replicas"
DEPLOYMENTS_CHANNEL = "modelkeeper_deployments"
#: NOTIFY channel for client API key changes (migration 0003); payload is a key prefix.
API_KEYS_CHANNEL = "modelkeeper_api_keys"

#: Signals, updates and queries of DeploymentWorkflow, by name, for senders that do not
#: import the workflow class (the API and the store activities).
SIGNAL_NODES_CHANGED = "nodes_changed"
SIGNAL_RETRY = "retry"
SIGNAL_DELETE = "delete"
UPDATE_SCALE = "scale"
QUERY_STATUS = "status"
