package jsonobj_test

import (
	"fmt"

	"github.com/pdq-dev/pdq/pkg/jsonobj"
)

func ExampleEdit() {
	body := []byte(`{"model":"m", "prompt":"<b>Hi</b>", "stream":true, "stream_options":{"include_usage":true}}`)
	out, err := jsonobj.Edit(body,
		jsonobj.Set("stream", []byte("false")),
		jsonobj.Set("max_tokens", []byte("1")),
		jsonobj.Delete("stream_options"))
	if err != nil {
		panic(err)
	}
	fmt.Println(string(out))
	// Output: {"model":"m", "prompt":"<b>Hi</b>", "stream":false,"max_tokens":1}
}

// A client's kv_transfer_params go in any letter case; a body without them
// comes back as it is, not copied.
func ExampleDeleteFold() {
	for _, body := range []string{`{"prompt":"x","KV_Transfer_Params":{}}`, `{"prompt":"x"}`} {
		out, err := jsonobj.Edit([]byte(body), jsonobj.DeleteFold("kv_transfer_params"))
		if err != nil {
			panic(err)
		}
		fmt.Println(string(out))
	}
	// Output:
	// {"prompt":"x"}
	// {"prompt":"x"}
}

func ExampleGet() {
	v, ok, err := jsonobj.Get([]byte(`{"a":1,"b":{"c":2},"a":3}`), "a")
	fmt.Println(string(v), ok, err)
	// Output: 3 true <nil>
}
