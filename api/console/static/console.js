// The console's own script: what htmx does not do by itself. No eval, no inline code:
// the pages' Content-Security-Policy allows scripts from this API only.
(function () {
  "use strict";
  // A refusal the console rendered (HTML: a viewer's 403, a 409 naming the running
  // operation) is shown where the answer goes; an error that is not the console's
  // (JSON, a proxy's page) leaves the page as it was.
  document.addEventListener("htmx:beforeSwap", function (event) {
    var xhr = event.detail.xhr;
    var type = xhr.getResponseHeader("Content-Type") || "";
    if (xhr.status >= 400 && type.indexOf("text/html") === 0) {
      event.detail.shouldSwap = true;
      event.detail.isError = false;
    }
  });
  // The banner: shown while the API does not answer the live parts' polls.
  function lost(on) {
    document.body.classList.toggle("lost", on);
  }
  document.addEventListener("htmx:sendError", function () { lost(true); });
  document.addEventListener("htmx:afterRequest", function (event) {
    if (event.detail.xhr && event.detail.xhr.status > 0 && event.detail.xhr.status < 500) {
      lost(false);
    }
  });

  // The events page: each entry the stream sends goes on top of the table, built as text
  // (never as HTML: an entry's message is whatever a deployment or node was named).
  function cell(row, text, className) {
    var td = document.createElement("td");
    td.textContent = text;
    if (className) { td.className = className; }
    row.appendChild(td);
    return td;
  }
  function follow() {
    var rows = document.getElementById("event-rows");
    var state = document.getElementById("stream-state");
    if (!rows || !rows.dataset.stream || !window.EventSource) { return; }
    var limit = parseInt(rows.dataset.limit || "100", 10);
    var source = new EventSource(rows.dataset.stream);
    source.onopen = function () { state.textContent = "live"; lost(false); };
    source.onerror = function () {
      // CLOSED: the API refused the stream (it does not reconnect); else it reconnects.
      state.textContent = source.readyState === EventSource.CLOSED
        ? "not following: reload the page" : "reconnecting…";
    };
    source.onmessage = function (message) {
      var entry = JSON.parse(message.data);
      var none = document.getElementById("no-events");
      if (none) { none.remove(); }
      var row = document.createElement("tr");
      row.className = "fresh";
      row.dataset.event = String(entry.event_id);
      cell(row, String(entry.event_id), "small");
      cell(row, String(entry.at || "").substring(11, 19), "small");
      var kind = document.createElement("span");
      kind.className = "kind";
      kind.textContent = entry.kind;
      cell(row, "", "").appendChild(kind);
      var what = cell(row, entry.message, "");
      if (entry.deployment_id) {
        var link = document.createElement("a");
        link.className = "small";
        link.href = "/ui/deployments/" + encodeURIComponent(entry.deployment_id);
        link.textContent = entry.deployment_id;
        what.appendChild(document.createTextNode(" "));
        what.appendChild(link);
      }
      cell(row, entry.actor || "", "small");
      rows.insertBefore(row, rows.firstChild);
      while (rows.children.length > limit) { rows.removeChild(rows.lastChild); }
    };
  }
  document.addEventListener("DOMContentLoaded", follow);
})();
